"""Planning: the cost model, auto mode's choice of strategy, and the analytic traffic per rank."""
