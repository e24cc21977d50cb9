"""The fleet and placement: what each replica holds and where an admitted request goes.

A replica's blended view, scraped telemetry and this gateway's own accounting (`replica`); a
model's replicas as one call sees them (`pool`); permits, what each admitted request holds on its
replica (`permits`); block digests and the prefix indexes built from what was sent or from the
engines' KV events (`blocks`, `prefix_index`, `kv_events`); the routers (`routing`); room,
deadlines per replica and the router's call (`placement`); decode workers' room in a
disaggregated fleet (`decode_room`).
"""
