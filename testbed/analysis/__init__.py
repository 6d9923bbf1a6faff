"""Results and what they mean: the results schema, aggregation and verdicts, the theory's predictions, number formatting."""
