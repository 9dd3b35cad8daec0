"""`python -m dspark.bench`: the benchmarks (`dspark.tools.bench`, chapter 35)."""
from dspark.tools.bench import main

if __name__ == "__main__":
    main()
