"""`python -m hybrid_opt demo`."""
from hybrid_opt.cli import main

raise SystemExit(main())
