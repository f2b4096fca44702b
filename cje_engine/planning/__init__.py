"""Budget planning: variance components, square-root allocation, MDE tables, iso-cost curves."""
