"""The one token loop (loop.Engine), the slots it serves, and the start-up both commands share."""
