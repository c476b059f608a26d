from pd.tools.route_bench.cli import main

main()
