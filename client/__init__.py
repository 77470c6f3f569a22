"""dspark_client: command-line client for a dspark Triton server."""
