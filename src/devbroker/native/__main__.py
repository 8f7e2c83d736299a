import sys
from devbroker.native import main
sys.exit(main())
