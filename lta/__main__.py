import sys

from lta.cli import main

sys.exit(main())
