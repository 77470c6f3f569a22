"""`python -m dspark.serving.openai_frontend`: see dspark.serving.openai_frontend.server."""

from dspark.serving.openai_frontend.server import main

raise SystemExit(main())
