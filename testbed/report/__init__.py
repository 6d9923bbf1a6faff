"""Writing the report of an experiment: the markdown document, its plots and sections."""
