from pd.tools.pd_bench.cli import main

main()
