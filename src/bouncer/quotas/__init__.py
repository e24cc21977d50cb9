"""Quotas: what a tenant, or a group of tenants, may spend over calendar windows (an hour, a day,
a week, a month), in tokens or money, and what happens past it (refused, demoted to a sheddable
band, or diverted to an overflow target).

- `settings`: the config's quota sections (limits, groups, prices, overflow targets);
- `windows`: calendar arithmetic, explicit time in, the window and its reset time out;
- `plan`: which limits a request is charged against and how much, from the config;
- `ledger`: the reservations' rules, and the in-process ledger (the simulator, tests);
  the gateways keep theirs in Redis (`bouncer.gateway.quota_store`), with the same rules.

A request reserves its expected cost (prompt plus predicted output) at admission, on every limit
that applies, in one atomic step; the answer's usage settles it (the unused part returns), and a
reservation nobody settles (its gateway died) is given back when its lease runs out.
"""
