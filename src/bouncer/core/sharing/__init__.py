"""Several gateways as one: the part of each gateway's state the others' decisions need.

What each gateway holds and serves and the fleet-wide order across gateways (`peers`), its part
gathered and the others' spread back (`exchange`), claims on nearly full replicas (`claims`), and
the stores several gateways share: rate limits (`rate_limits`), first attempts (`retries`) and
prefixes sent where engines publish no KV events (`prefixes`).
"""
