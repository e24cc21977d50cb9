import sys

from bouncer.reference import main

sys.exit(main())
