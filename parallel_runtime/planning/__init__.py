"""Planning: the cost model (`costmodel`), memory per rank against the workers' budgets (`memory`), auto mode's
choice of strategy (`auto`) and the analytic traffic per rank (`traffic`)."""
