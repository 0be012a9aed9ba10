"""Built-in tasks with ground-truth checkers, so the whole pipeline runs offline."""
