"""Flow control: who waits, in which order, for how long, and who goes next.

The waiting room's doors at arrival (`waiting_room`); the queues themselves, bands of tenants'
queues with a TTL heap (`queues`) and the two policies that order them (`fairness`, `ordering`);
a request's deadlines and whether it can still be on time (`deadlines`, `standing_queue`, and the
bands' protection, `band_slos`); how long a newcomer would wait (`backlog`); when the pool is too
full to dispatch (`saturation`); and the dispatch loop (`dispatch`).
"""
