"""The reference pages generated from the code (docs/reference/): the configuration from the
pydantic models, the metrics from the collectors, the CLI from argparse, the HTTP API from
docs/openapi.yaml. `bouncer reference` writes them (`pages`); `bouncer reference --check` names the pages
that differ from what the code says now (the tests run it)."""
