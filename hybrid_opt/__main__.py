"""`python -m hybrid_opt demo` and `python -m hybrid_opt plan`."""

from hybrid_opt.cli import main

raise SystemExit(main())
