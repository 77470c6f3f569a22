"""`python -m dspark.openai_frontend`: see dspark.openai_frontend.server."""

from dspark.openai_frontend.server import main

raise SystemExit(main())
