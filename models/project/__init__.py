"""Project infrastructure the algorithm never imports: the environment (``settings``), the pipeline's names
(``names``), the project folder and its model pairs (``pairs``), the card of exported probes
(``probe_card``) and where such a folder is, a local one or a Hub repo (``probe_folder``)."""
