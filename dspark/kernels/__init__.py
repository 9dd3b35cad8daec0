"""Floor 4: Triton kernels, tensors in and tensors out, each beside the torch reference it reproduces."""
