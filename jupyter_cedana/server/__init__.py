"""The Jupyter server extension: the app, its REST API, the policy loop, the
message gate, parking and adoption."""
