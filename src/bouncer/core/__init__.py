"""The admission core: pure and synchronous, every entry point takes `now`; no IO, no clock.

A request's path, and where each step lives:

- `admission.AdmissionCore` holds the entry points (`precheck`, `offer`, `tick`, `started`,
  `finished`, `cancel`, `observe`, ...) and builds the parts below from the config;
- `arrivals` takes a new request through the layers in order: `intake` (who, valid, context,
  breaker, rate limits), then `flow` (the waiting room's doors, deadlines, the queues); `precheck`
  runs those that need no prompt, before the gateway tokenizes one;
- `flow.dispatch` lets queued requests go, highest band first, to a replica `fleet.placement`
  finds with room, in time and warm (`agents` holds an agent's next step while its window is full);
- `finaliser` is the one place a request ends; `learning` takes what its first token and end teach;
- `outcomes` holds the events the shells get back, `requests` a request as the core sees it,
  `model_state` one model's state, `stores` where shared state lives (`sharing` for several
  gateways), `registry` the policies by name, and `view` what the shells may read.
"""
