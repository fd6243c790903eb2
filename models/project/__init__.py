"""Project infrastructure the algorithm never imports: the environment (``settings``), the pipeline's names
(``names``), the project folder and its model pairs (``pairs``), and the card of exported probes
(``probe_card``)."""
