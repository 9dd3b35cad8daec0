"""Floor 6: what runs a step on a device: step buffers, the static forward, CUDA graphs, fused rounds, overlap, the
memory profile. The floor that switches fast paths on: on CUDA it registers the sampling kernels with the sampling
floor below (`dspark.sample.sampling.FAST`), which never imports the kernels itself."""
import torch

if torch.cuda.is_available():
    from dspark.kernels import sample  # noqa: F401  (importing it registers the kernels)
