"""Agents: how many agent sessions may be active at once, and where their steps go.

The window itself, AIMD on KV usage and prefix hits after CONCUR (`window`), and the gate the
rest of the core sees, a no-op when agents are off (`gate`).
"""
