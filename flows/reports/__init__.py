"""Things for people: the HTML report and the terminal tables."""
