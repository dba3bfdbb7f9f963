"""Model families behind the batched seam: each file writes its layers, none writes batching."""
