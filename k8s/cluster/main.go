// Command kube is the test cluster's Kubernetes in one binary: the four server components
// and kubectl, all from k8s.io/kubernetes v1.37.2 (see go.mod). One multi-call binary
// rather than five links the shared half of Kubernetes once: the warm rebuild is one link,
// and the cache holds one copy of each compiled package.
//
//	kube kube-apiserver|kube-scheduler|kube-controller-manager|kubelet|kubectl [flags]
//
// or a link named after the component (argv[0]). Each case does what that component's own
// main in k8s.io/kubernetes/cmd does; scripts/k8s/build.sh stamps the version (-X) as the
// release build would, since a module build has none.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	_ "time/tzdata" // CronJob time zones, as the upstream mains have it

	"github.com/spf13/cobra"
	_ "k8s.io/client-go/plugin/pkg/client/auth" // kubectl's client auth plugins
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // --logging-format=json
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

const usage = "usage: kube kube-apiserver|kube-scheduler|kube-controller-manager|kubelet|kubectl [flags]"

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if name == "kube" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, usage)
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	var cmd *cobra.Command
	switch name {
	case "kube-apiserver":
		cmd = apiserver.NewAPIServerCommand()
	case "kube-scheduler":
		cmd = scheduler.NewSchedulerCommand()
	case "kube-controller-manager":
		cmd = controllermanager.NewControllerManagerCommand()
	case "kubelet":
		cmd = kubelet.NewKubeletCommand(context.Background())
	case "kubectl":
		runKubectl(args)
		return
	default:
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	cmd.SetArgs(args)
	os.Exit(cli.Run(cmd))
}

// runKubectl does what k8s.io/kubernetes/cmd/kubectl does: kubectl reads its own -v before
// building the command tree, and prints errors its own way.
func runKubectl(args []string) {
	argv := append([]string{"kubectl"}, args...)
	logs.GlogSetter(kubectl.GetLogVerbosity(argv)) // nolint:errcheck
	os.Args = argv
	command := kubectl.NewDefaultKubectlCommand()
	command.SetArgs(args)
	if err := cli.RunNoErrOutput(command); err != nil {
		kubectlutil.CheckErr(err)
	}
	os.Exit(0)
}
