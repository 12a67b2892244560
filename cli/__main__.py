import sys

from lit_mhar.cli import main

sys.exit(main())
