"""What a compiled job shows a person: explain(), the HTML report, its graph, the plans page."""
