"""Reading runs for people: the run view, the results store, the HTML/Markdown report, charts and the dashboard."""
