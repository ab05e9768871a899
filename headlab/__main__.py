"""`python -m headlab` (and `torchrun -m headlab`) run the `headlab` command."""

from headlab.cli import main

main()
