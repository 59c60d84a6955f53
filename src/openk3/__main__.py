import sys

from openk3.cli import main

sys.exit(main())
