"""Speed and scale figures. Each benchmark prints one JSON line per figure with ratios against a
baseline measured in the same run; none of them is a test."""
