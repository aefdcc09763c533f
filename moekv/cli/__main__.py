"""`python -m moekv.cli`."""
import sys

from moekv.cli import main

sys.exit(main())
