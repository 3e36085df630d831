/**
 * jupyter-cedana's JupyterLab extension: a sidebar of kernels with suspend,
 * resume and keep-awake, the suspended state on each notebook, a status bar
 * item and palette commands.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  ICommandPalette,
  InputDialog,
  Notification
} from '@jupyterlab/apputils';
import {
  INotebookTracker,
  NotebookActions,
  NotebookPanel
} from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Signal } from '@lumino/signaling';

import { formatBytes, formatDuration } from './format';
import { cedanaIcon } from './icons';
import { KernelSuspendIndicator } from './indicator';
import { CedanaModel, DEFAULT_REFRESH_INTERVAL, IEventSource } from './model';
import { CedanaPanel, KEEP_AWAKE_CHOICES, notifyError } from './panel';
import { CedanaStatusItem } from './statusbar';

export { CedanaModel } from './model';
export * from './request';
export * from './types';

/** The plugin id; also names the settings schema (schema/plugin.json). */
export const PLUGIN_ID = 'jupyter-cedana:plugin';

/** The command ids. */
export namespace CommandIDs {
  export const suspend = 'cedana:suspend-kernel';
  export const resume = 'cedana:resume-kernel';
  export const keepAwake = 'cedana:keep-awake';
  export const openPanel = 'cedana:open-panel';
  export const refresh = 'cedana:refresh';
}

const CATEGORY = 'Kernel Suspend';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'Suspend idle kernels to disk, free their GPU, resume them on the next cell.',
  autoStart: true,
  optional: [
    ILayoutRestorer,
    ICommandPalette,
    INotebookTracker,
    ISettingRegistry,
    IStatusBar
  ],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    tracker: INotebookTracker | null,
    settingRegistry: ISettingRegistry | null,
    statusBar: IStatusBar | null
  ) => {
    const services = app.serviceManager;
    const events = (services as { events?: IEventSource }).events;
    const model = new CedanaModel({
      serverSettings: services.serverSettings,
      sessions: services.sessions,
      events
    });

    // Failures the server reports without a request of ours (e.g. a restore
    // triggered by running a cell).
    model.failed.connect((_, failure) => {
      const where = failure.path ?? `kernel ${failure.kernelId.slice(0, 8)}`;
      Notification.error(`${where}: ${failure.message}`, { autoClose: 15000 });
    });

    // The sidebar.
    const panel = new CedanaPanel(model);
    panel.title.icon = cedanaIcon;
    app.shell.add(panel, 'left', { rank: 750 });
    if (restorer) {
      restorer.add(panel, 'jupyter-cedana-panel');
    }

    // The notebook indicator.
    app.docRegistry.addWidgetExtension('Notebook', {
      createNew: (widget: NotebookPanel) => {
        const item = new KernelSuspendIndicator(model, widget.sessionContext);
        if (!widget.toolbar.insertAfter('kernelName', 'cedanaSuspend', item)) {
          widget.toolbar.addItem('cedanaSuspend', item);
        }
        return item;
      }
    });

    // Running a cell on a suspended kernel restores it: show that at once.
    if (tracker) {
      NotebookActions.executionScheduled.connect((_, args) => {
        const nbPanel = tracker.find(p => p.content === args.notebook);
        const id = nbPanel?.sessionContext.session?.kernel?.id;
        if (id) {
          model.noteExecution(id);
        }
      });
    }

    // The status bar.
    let showStatusBar = true;
    const statusChanged = new Signal<typeof model, void>(model);
    if (statusBar) {
      const item = new CedanaStatusItem(model, () => {
        void app.commands.execute(CommandIDs.openPanel);
      });
      statusBar.registerStatusItem('jupyter-cedana:status', {
        item,
        align: 'left',
        rank: 5,
        isActive: () => showStatusBar,
        activeStateChanged: statusChanged
      });
    }

    // Settings.
    if (settingRegistry) {
      const apply = (settings: ISettingRegistry.ISettings) => {
        const interval = settings.get('refreshInterval').composite;
        model.refreshInterval =
          typeof interval === 'number' && interval > 0
            ? interval
            : DEFAULT_REFRESH_INTERVAL;
        const show = settings.get('showStatusBarItem').composite !== false;
        if (show !== showStatusBar) {
          showStatusBar = show;
          statusChanged.emit();
        }
      };
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(settings);
          settings.changed.connect(apply);
        })
        .catch(reason => {
          console.error('jupyter-cedana: cannot load settings', reason);
        });
    }

    // Commands.
    const kernelIdOf = (args: Record<string, unknown>): string | null => {
      if (typeof args.kernelId === 'string' && args.kernelId) {
        return args.kernelId;
      }
      return tracker?.currentWidget?.sessionContext.session?.kernel?.id ?? null;
    };
    const stateOf = (args: Record<string, unknown>) => {
      const id = kernelIdOf(args);
      return id ? model.get(id)?.state : undefined;
    };

    app.commands.addCommand(CommandIDs.suspend, {
      label: 'Suspend Kernel (free its GPU)',
      caption: "Checkpoint the current notebook's kernel to disk",
      icon: cedanaIcon,
      isEnabled: args => {
        const id = kernelIdOf(args);
        if (!id || model.isPending(id)) {
          return false;
        }
        const kernel = model.get(id);
        return !kernel || (kernel.state === 'running' && kernel.suspendable);
      },
      execute: async args => {
        const id = kernelIdOf(args);
        if (!id) {
          return;
        }
        try {
          const kernel = await model.suspend(id);
          Notification.info(
            `Kernel suspended in ${formatDuration(kernel.last_suspend_seconds)}` +
              (kernel.checkpoint_bytes
                ? ` (checkpoint ${formatBytes(kernel.checkpoint_bytes)})`
                : ''),
            { autoClose: 4000 }
          );
        } catch (error) {
          notifyError('Suspend failed', error);
        }
      }
    });

    app.commands.addCommand(CommandIDs.resume, {
      label: 'Resume Suspended Kernel',
      caption: "Resume the current notebook's kernel now",
      isEnabled: args => {
        const id = kernelIdOf(args);
        if (!id || model.isPending(id)) {
          return false;
        }
        const state = stateOf(args);
        return (
          state === undefined || state === 'suspended' || state === 'failed'
        );
      },
      execute: async args => {
        const id = kernelIdOf(args);
        if (!id) {
          return;
        }
        try {
          const kernel = await model.resume(id);
          Notification.info(
            `Kernel resumed in ${formatDuration(kernel.last_resume_seconds)}`,
            { autoClose: 4000 }
          );
        } catch (error) {
          notifyError('Resume failed', error);
        }
      }
    });

    app.commands.addCommand(CommandIDs.keepAwake, {
      label: args =>
        typeof args.seconds === 'number'
          ? `Keep Kernel Awake for ${formatDuration(args.seconds)}`
          : 'Keep Kernel Awake…',
      caption:
        "Postpone the automatic suspend of the current notebook's kernel",
      isEnabled: args => {
        const id = kernelIdOf(args);
        if (!id || model.isPending(id)) {
          return false;
        }
        const state = stateOf(args);
        return state === undefined || state === 'running';
      },
      execute: async args => {
        const id = kernelIdOf(args);
        if (!id) {
          return;
        }
        let seconds: number | null =
          typeof args.seconds === 'number' ? args.seconds : null;
        if (seconds === null) {
          const labels = KEEP_AWAKE_CHOICES.map(c => c.label);
          const choice = await InputDialog.getItem({
            title: 'Keep the kernel awake for',
            items: labels,
            current: 1
          });
          if (!choice.button.accept || choice.value === null) {
            return;
          }
          seconds =
            KEEP_AWAKE_CHOICES.find(c => c.label === choice.value)?.seconds ??
            null;
          if (seconds === null) {
            return;
          }
        }
        try {
          await model.keepAwake(id, seconds);
          Notification.info(
            `Kernel kept awake for ${formatDuration(seconds)}`,
            { autoClose: 4000 }
          );
        } catch (error) {
          notifyError('Keep awake failed', error);
        }
      }
    });

    app.commands.addCommand(CommandIDs.openPanel, {
      label: 'Show Kernel Suspend Panel',
      execute: () => {
        app.shell.activateById(panel.id);
      }
    });

    app.commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh Kernel Suspend State',
      execute: () => model.refresh()
    });

    if (palette) {
      for (const command of [
        CommandIDs.suspend,
        CommandIDs.resume,
        CommandIDs.keepAwake,
        CommandIDs.openPanel,
        CommandIDs.refresh
      ]) {
        palette.addItem({ command, category: CATEGORY });
      }
    }

    // Update the commands' enabled state as kernels change.
    model.changed.connect(() => app.commands.notifyCommandChanged());
    tracker?.currentChanged.connect(() => app.commands.notifyCommandChanged());
  }
};

export default plugin;
