"""The flight recorder: what the gateway decided and saw, sampled at a fixed step into a bounded
ring (`timeline.Timeline`), read as JSON or a live stream at /admin/timeline and drawn by the
page at /ui (`page`). The simulator records its runs in the same format (`bouncer bench run
--record`), and `bouncer recorder FILE` serves the same page for a file."""
