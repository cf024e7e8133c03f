import sys

from lowmem_ft.cli import main

sys.exit(main())
