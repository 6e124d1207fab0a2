"""One module per notebook: the experiment functions it calls (and its Explore
widgets re-call). Each returns a DataFrame and records its arms in `Results`."""
