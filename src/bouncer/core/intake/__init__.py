"""Intake: the first layers a request meets, cheapest first, before it may join a queue.

Who it is (`tenant_book`), whether it is valid and fits the context (`checks`), its tenant's
circuit breaker and rate limits (`breaker`, `rate_limit`), a client's retry keeping its first
deadline (`retries`), and outside pressure that sheds bands or tenants (`pressure`).
"""
