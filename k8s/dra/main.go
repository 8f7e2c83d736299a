// devbroker-dra-plugin: the kubelet plugin of the DRA driver gpu.devbroker.io.
//
// It publishes this node's broker GPUs as one ResourceSlice (pool = node name),
// each a device many claims share by consumable capacity (memory, compute), and
// turns each claim the kubelet prepares here into a broker tenant with a CDI
// device (docs/kubernetes.md).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	"devbroker.io/k8s/dra/internal/broker"
	"devbroker.io/k8s/dra/internal/driver"
)

// SeccompProfile is the name pods give as their Localhost seccomp profile
// (securityContext.seccompProfile.localhostProfile) to hand their containers'
// seccomp listener to the broker.
const SeccompProfile = "devbroker.json"

type config struct {
	runDir, nodeName, cdiDir, kubeconfig string
	pluginDir, registrarDir, seccompDir  string
	devbroker, frontend                  string
	grace, brokerWait                    time.Duration
}

func main() {
	var c config
	flag.StringVar(&c.runDir, "run-dir", "/run/devbroker", "the node broker's run directory (devbroker --run-dir)")
	flag.StringVar(&c.nodeName, "node-name", os.Getenv("NODE_NAME"), "this node's name (the pool name); default $NODE_NAME")
	flag.StringVar(&c.cdiDir, "cdi-dir", "/var/run/cdi", "where the container runtime reads CDI specs")
	flag.StringVar(&c.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster)")
	flag.StringVar(&c.pluginDir, "plugin-dir", filepath.Join(kubeletplugin.KubeletPluginsDir, driver.DriverName),
		"the plugin's directory (its dra.sock), under the kubelet's root dir")
	flag.StringVar(&c.registrarDir, "registrar-dir", kubeletplugin.KubeletRegistryDir,
		"the kubelet's plugin registration directory (ROOT/plugins_registry)")
	flag.StringVar(&c.seccompDir, "seccomp-dir", "/var/lib/kubelet/seccomp",
		"the kubelet's seccomp profile directory (ROOT/seccomp): the plugin writes "+SeccompProfile+" there; empty: none")
	flag.StringVar(&c.devbroker, "devbroker", "devbroker", "the devbroker command")
	flag.StringVar(&c.frontend, "frontend", "auto", "the tenants' nodes in containers: fuse, seccomp, or auto (seccomp with the real backend)")
	flag.DurationVar(&c.grace, "grace", 5*time.Second, "a removed claim's processes: SIGTERM, then SIGKILL after this")
	flag.DurationVar(&c.brokerWait, "broker-wait", 2*time.Minute, "how long to wait for the broker at start")
	klog.InitFlags(nil)
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, c); err != nil {
		klog.ErrorS(err, "devbroker-dra-plugin")
		klog.Flush()
		os.Exit(1)
	}
}

func run(ctx context.Context, c config) error {
	if c.nodeName == "" {
		return errors.New("--node-name (or $NODE_NAME) is required")
	}
	var restConfig *rest.Config
	var err error
	if c.kubeconfig != "" {
		restConfig, err = clientcmd.BuildConfigFromFlags("", c.kubeconfig)
	} else {
		restConfig, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	kube, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}

	client := &broker.Client{RunDir: c.runDir, Timeout: c.grace + 30*time.Second}
	gpus, backend, err := waitForBroker(ctx, client, c.brokerWait)
	if err != nil {
		return err
	}
	frontend := c.frontend
	if frontend == "auto" {
		frontend = "fuse"
		if backend == "real" {
			frontend = "seccomp"
		}
	}
	if frontend != "fuse" && frontend != "seccomp" {
		return fmt.Errorf("--frontend %q: fuse, seccomp or auto", c.frontend)
	}
	for _, dir := range []string{c.pluginDir, c.registrarDir, c.cdiDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return err
		}
	}
	if c.seccompDir != "" {
		if err := writeSeccompProfile(c, frontend); err != nil {
			return err
		}
	}

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	byIndex := map[int]broker.GPU{}
	for _, g := range gpus {
		byIndex[g.Index] = g
	}
	plugin := &driver.Plugin{
		NodeName: c.nodeName,
		Broker:   client,
		CDI:      driver.DevbrokerCDI{Devbroker: c.devbroker, RunDir: c.runDir, Frontend: frontend},
		CDIDir:   c.cdiDir,
		Kube:     kube,
		GPUs:     byIndex,
		Grace:    c.grace,
		Cancel:   cancel,
	}
	helper, err := kubeletplugin.Start(ctx, plugin,
		kubeletplugin.DriverName(driver.DriverName),
		kubeletplugin.NodeName(c.nodeName),
		kubeletplugin.KubeClient(kube),
		kubeletplugin.PluginDataDirectoryPath(c.pluginDir),
		kubeletplugin.RegistrarDirectoryPath(c.registrarDir),
		kubeletplugin.HealthService(false),
	)
	if err != nil {
		return err
	}
	defer helper.Stop()
	resources := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		c.nodeName: {Slices: []resourceslice.Slice{{Devices: driver.Devices(gpus, backend)}}},
	}}
	if err := helper.PublishResources(ctx, resources); err != nil {
		return err
	}
	klog.InfoS("serving", "driver", driver.DriverName, "node", c.nodeName, "gpus", len(gpus),
		"backend", backend, "frontend", frontend, "plugin", c.pluginDir, "registrar", c.registrarDir)
	<-ctx.Done()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

// waitForBroker asks the broker for its GPUs until it answers (it may start after
// the plugin) or wait has passed.
func waitForBroker(ctx context.Context, client *broker.Client, wait time.Duration) ([]broker.GPU, string, error) {
	deadline := time.Now().Add(wait)
	for {
		gpus, backend, err := client.GPUs()
		if err == nil {
			if len(gpus) == 0 {
				return nil, "", errors.New("the broker has no GPU")
			}
			return gpus, backend, nil
		}
		if time.Now().After(deadline) {
			return nil, "", err
		}
		klog.InfoS("waiting for the broker", "err", err)
		select {
		case <-ctx.Done():
			return nil, "", ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// writeSeccompProfile writes the Localhost seccomp profile pods name to hand their
// seccomp listener to the broker: `devbroker oci-seccomp --tenant-from-cdi`, whose
// listener metadata tells the broker to take the tenant from the CDI device the
// runtime applied to the container (a pod cannot name the profile of a claim
// that does not exist yet).
func writeSeccompProfile(c config, frontend string) error {
	out, err := exec.Command(c.devbroker, "--run-dir", c.runDir, "oci-seccomp", "--frontend", frontend,
		"--tenant-from-cdi").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return fmt.Errorf("devbroker oci-seccomp: %v: %s", err, ee.Stderr)
		}
		return fmt.Errorf("devbroker oci-seccomp: %w", err)
	}
	if err := os.MkdirAll(c.seccompDir, 0o755); err != nil {
		return err
	}
	path := filepath.Join(c.seccompDir, SeccompProfile)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, out, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
