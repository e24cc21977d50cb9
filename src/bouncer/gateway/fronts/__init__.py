"""The two fronts over one control plane (`bouncer.gateway.control_plane`): the HTTP proxy
(`proxy`: clients talk to Bouncer, which relays the bytes) and the endpoint picker (`picker`:
clients talk to Envoy, which asks Bouncer where each request goes and carries the bytes itself)."""
