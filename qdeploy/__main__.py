import sys

from qdeploy.cli import main

sys.exit(main())
