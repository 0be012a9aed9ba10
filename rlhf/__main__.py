"""`python -m rlhf ...` (and so `torchrun -m rlhf ...`) runs the CLI."""

from rlhf.cli import main

if __name__ == "__main__":
    main()
