import sys

from teratrain.cli import main

sys.exit(main())
