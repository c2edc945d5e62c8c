"""Planning: PipeFusion's stage split (`stages`), the cost model (`costmodel`), auto mode's choice of strategy
(`auto`) and the analytic traffic per rank (`traffic`)."""
