"""``python -m recstack ...`` (also what ``torchrun -m recstack`` runs)."""

import sys

from recstack.cli.main import main

sys.exit(main())
