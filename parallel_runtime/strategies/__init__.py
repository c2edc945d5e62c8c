"""The parallel strategies, written once against the model-family seam: attention splits, PipeFusion, the step loop."""
