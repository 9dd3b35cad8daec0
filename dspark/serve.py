"""`python -m dspark.serve`: the OpenAI-compatible server (`dspark.entrypoints.serve`, chapter 33)."""
import sys

from dspark.entrypoints.serve import main

if __name__ == "__main__":
    sys.exit(main())
