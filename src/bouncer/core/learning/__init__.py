"""What the core learns from the requests it let through.

The engine's step time (`step_time`, fitted online by `step_time_learner`), each replica's TTFT
and TPOT prediction from it (`latency`), its bands' measured prediction error (`ttft_margin`),
expected output lengths (`output_length`), and the one place the core takes these lessons from a
request's first token and end (`feedback`).
"""
