"""Judge-to-oracle calibrators (scikit-learn style), monotone in the judge score."""
