"""Pure scheduling logic: requests, sampling parameters, step plans and the scheduler.

Nothing here imports llama.cpp or reads a clock; tests drive it with no model.
"""
