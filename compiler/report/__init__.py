"""What a compiled job shows a person: explain(), show(), the HTML report, its graph, the plans page."""
